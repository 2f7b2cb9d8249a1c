"""Reference code, not a production path: the single-request stack (one prompt, n samples in
lockstep over a dense per-request KV layout) that `LLM.sample` ran before it moved onto the
engine. It stays as the oracle the engine is tested against (`tests/test_engine*.py`) and as
the baseline `python -m bench sweep --paths single-request` times side by side with the engine.
"""
