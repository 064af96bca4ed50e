"""The planner's model of the decoder-only families (dense and Mixture-of-Experts): the
estimates of `plan.estimate` and the search rules of `plan.search` as they are."""

from __future__ import annotations

from tessera.plan import estimate as E
from tessera.plan.models.family import PlanFamily

DECODER = PlanFamily(memory=E.decoder_memory, step_time=E.decoder_step_time,
                     step_flops=E.decoder_step_flops)
