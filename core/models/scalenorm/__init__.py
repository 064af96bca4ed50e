"""ScaleNorm: the decoder with each norm a single learned scale of the unit-length hidden state
(Nguyen & Salazar 2019, https://arxiv.org/abs/1910.05895). A new decoder family is this folder
and one registry line (`core.models.registry`)."""
