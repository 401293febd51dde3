"""The one `attnres-serve` of the tiny random model that several test modules share for the session.

A server start is three processes that each import vLLM (the API server, the engine core and its
worker; about 50 s of CPU on 2 cores), so the modules that need nothing but this model behind a key
share one: each sets `SHARED_SERVER = True` (the `server` and `server_cache` fixtures of
tests/serving/conftest.py then give them the `shared_server` fixture's), and tests/conftest.py lists
them in `SHARED_SERVER_MODULES`, so that `make test`'s workers run them on one worker."""

from attnres.serving.defaults import RANDOM_MODEL

MAX_MODEL_LEN = 256
ARGS = [RANDOM_MODEL, "--dtype", "float32", "--kv-cache-memory-bytes", "64M", "--max-model-len", str(MAX_MODEL_LEN),
        "--enforce-eager", "--max-num-seqs", "32", "--seed", "0"]
# The key covers every route but the health checks (serving/auth.py); the clients send it.
API_KEY = "test-key-4711"
