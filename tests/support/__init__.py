"""What many test modules share, written once: bounded subprocesses (`processes`), the transformers
references (`reference`) and in-process vLLM engines (`engines`). Test modules import from here, never
from each other."""
