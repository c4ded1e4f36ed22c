"""`kvtide demo`: the sections that drive the engine from outside, as a user would (the chat, resident
compression, restoration). ``run_demo`` is what the command runs."""
from .chat import run_demo

__all__ = ["run_demo"]
