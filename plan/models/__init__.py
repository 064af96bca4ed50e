"""The planner's view of each model family (formulas, estimates, search rules) and its registry."""
