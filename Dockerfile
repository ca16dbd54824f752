# The image docker-compose.yml runs: taskguard with its Celery, RQ and Prometheus extras, and the
# examples (the Celery outbox app and the RQ jobs).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY taskguard ./taskguard
COPY integrations ./integrations
RUN pip install --no-cache-dir ".[celery,rq,prometheus]" flower
COPY examples ./examples
ENV PYTHONPATH=/app:/app/examples/outbox:/app/examples/rq_sync \
    PROMETHEUS_MULTIPROC_DIR=/tmp/taskguard-metrics \
    TASKGUARD_METRICS=1
RUN mkdir -p /tmp/taskguard-metrics
