"""The planner's model of T5 (encoder-decoder): counts, estimates and what it may propose."""
