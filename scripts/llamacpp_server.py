"""llama.cpp's own OpenAI server (PyPI xllamacpp) on a GGUF: the baseline the inference
benchmark drives with the same requests as ARL's engine.

usage: llamacpp_server.py MODEL.gguf PORT PARALLEL THREADS
Prints "ready" once listening; serves until killed.
"""
import os
import sys
import time

import xllamacpp as xlc


def main() -> None:
    model, port, parallel, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    params = xlc.CommonParams()
    params.model.path = model
    params.port = port
    params.n_parallel = parallel
    params.n_ctx = 1024 * parallel
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.warmup = True
    server = xlc.Server(params)
    print("ready", server.listening_address, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
