"""Agentic environments for the RL loop: the sandbox every command of an episode runs in
(`glm5.rl.envs.sandbox`), and the environments built on it.

Usable on their own (nothing here needs torch or the engine); nothing is imported eagerly, so
`import glm5.rl.envs` costs nothing.
"""
