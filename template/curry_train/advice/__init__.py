"""The advice: the next-primitive advisor, the layout planner and the capacity sweep (built on the estimator)."""
