# One image for every Tandem role (gateway, prefill, decode); the command picks the role.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make gcc && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/tandem
COPY . .
RUN bash scripts/setup-venv.sh && .venv/bin/tandem model prepare
ENV PATH=/opt/tandem/.venv/bin:$PATH TANDEM_HOME=/root/.cache/tandem
ENTRYPOINT ["tandem"]
