"""The scheduler: the engine's turn, the batch step over its sequence slots, the prefix cache, and the engine
thread that runs the steps.

- `turn`: the FIFO of requests waiting for a slot.
- `batcher`: jobs on the slots of one engine context, the step that advances them, the prefix cache.
- `engine_loop`: the engine thread that runs the steps, and the relay of its tokens to the requests' tasks.
- `engine_like`: `EngineLike`, what all of these call on an engine.
"""
