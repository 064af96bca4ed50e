"""Prompt tuning and p-tuning of a frozen model, and the PEFT format of their prompts.

`tessera tune` (`tuning.cli`) trains virtual prompts per task (`tuning.prompts`) on examples
(`tuning.data`) with the pretraining machinery (`tuning.loop`), and writes a prompt table
(`core.prompt_table`) that the server loads with `load_prompt_tables(dirs, base_checkpoint)`.
"""
