"""One training iteration and the loop around it: plans, the step, metrics, logging, the non-finite stop."""
