"""A machine whose load the test decides, whatever else runs on the one it runs on.

fastbert reads the machine's load in one place, ``fastbert.threads.sample()``: a CPU forward's thread count follows
it, and a one-time measurement (fastbert/cpu.py) is kept only where it says the measurement's threads had the CPU.
A test that needs a quiet machine, or a given load, puts a ``Load`` in its place, in its own process or in one it
starts (with this folder on ``PYTHONPATH``):

    monkeypatch.setattr(threads, "sample", Load(others=0))
    subprocess.run([sys.executable, "-c", "import machine_load; machine_load.stand_in(others=0); ..."],
                   env={**os.environ, "PYTHONPATH": machine_load.FOLDER})

Real busy processes still test how fastbert reads a real machine: more load than a test starts only adds to it.
"""

import os
import threading
import time

from fastbert import threads

FOLDER = os.path.dirname(os.path.abspath(__file__))


class Load:
    """What ``threads.sample()`` reads on a machine whose CPUs (those in this process's mask) are all busy: other
    processes keep ``others`` of them busy, this process's threads the rest. The counters advance with the wall
    clock; setting ``others`` changes the load from then on."""

    def __init__(self, others: float = 0.0):
        self.cpus = threads.affinity()
        self.others = others
        self._lock = threading.Lock()
        self._at, self._busy, self._own = time.monotonic(), 0.0, 0.0

    def __call__(self) -> tuple[float, float, float]:
        with self._lock:
            now = time.monotonic()
            elapsed, self._at = now - self._at, now
            self._busy += self.cpus * elapsed
            self._own += (self.cpus - min(self.others, self.cpus)) * elapsed
            return now, self._busy, self._own


def stand_in(others: float = 0.0) -> Load:
    """From now on this process's fastbert reads the machine as ``Load(others)``."""
    load = Load(others)
    threads.sample = load
    return load
