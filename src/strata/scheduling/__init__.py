"""The scheduler: the engine's turn, the batch step over its sequence slots, the prefix cache, and the engine
thread that runs the steps."""
