"""Shared test setup: the tests folder is importable (stubs, fixtures)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
