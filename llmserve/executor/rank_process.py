"""A tensor-parallel rank that the engine spawned: `python -m llmserve.executor.rank_process <arguments>`, where the
arguments are run_worker's, pickled by the engine's own process (executor/multiproc.py)."""

import base64
import pickle
import sys

from llmserve.executor.multiproc import run_worker

if __name__ == "__main__":
    run_worker(*pickle.loads(base64.b64decode(sys.argv[1])))
