"""The tests' live servers start through kvtide's own threaded runner (the demo's too)."""
from kvtide.server.threaded import app_thread

__all__ = ["app_thread"]
