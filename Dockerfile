# The image docker-compose.yml runs: taskguard with its Celery, RQ and Prometheus extras, and the
# examples (the Celery outbox app and the RQ jobs).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY taskguard ./taskguard
COPY integrations ./integrations
RUN pip install --no-cache-dir ".[celery,rq,prometheus]" flower
COPY examples ./examples
# the metrics samples of every container's processes, on the volume docker-compose.yml shares
# between them (app-data at /data): docker-compose.yml gives each container a subdirectory of its
# own (taskguard creates it), and the metrics service serves the sum of them all
ENV PYTHONPATH=/app:/app/examples/outbox:/app/examples/rq_sync \
    PROMETHEUS_MULTIPROC_DIR=/data/metrics \
    TASKGUARD_METRICS=1
RUN mkdir -p /data/metrics
