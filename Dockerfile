# One image for web, worker and migrate. CPU torch by default; for GPU workers build with
#   docker compose build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY rollout_lens ./rollout_lens
COPY server ./server
COPY trainer ./trainer
COPY migrations ./migrations
COPY web ./web
# A plain (not editable) install of the package: templates, static files and migrations are in it.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0 \
 && pip install --no-cache-dir -c constraints.txt '.[train]' \
 && rm -rf /src
WORKDIR /app
ENV ROLLOUT_LENS_DATA_DIR=/data
VOLUME /data
EXPOSE 8000
CMD ["rollout-lens", "serve", "--host", "0.0.0.0", "--port", "8000"]
