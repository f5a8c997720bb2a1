# Prometheus from Debian's package, for machines where the prom/prometheus image cannot be pulled
# (docker-compose.local.yml builds it on the debootstrapped base):
#
#   docker build -f ops/prometheus.Dockerfile -t pagedkv-prometheus:local \
#     --build-arg BASE_IMAGE=pagedkv-base:bookworm --network host ops
#
# Flags are Prometheus' own, as with the upstream image: the compose file's `command` passes
# --config.file=/etc/prometheus/prometheus.yml; the TSDB lives in /var/lib/prometheus.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

USER prometheus
WORKDIR /var/lib/prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus", "--storage.tsdb.path=/var/lib/prometheus/metrics2"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
