"""The asynchronous RL loop: rollouts over the serving engine, a GRPO trainer, weight sync by
diffs, an experience pool, a dynamic task-ratio sampler, orchestration embedded or on Ray.

rl -> engine -> core -> ops: nothing here is imported by a lower layer, and Ray / Redis are
imported only where they are used.
"""
