"""The hardware-neutral model and RL loop. Calls hot paths only through glm5.ops."""
