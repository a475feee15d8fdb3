# GPU image: NVIDIA's PyTorch container already carries torch, CUDA, NCCL (and apex).
FROM nvcr.io/nvidia/pytorch:24.05-py3
WORKDIR /workspace/megatron-gpt
COPY requirements.txt .
# torch is provided by the base image; install the rest without touching it.
RUN grep -v '^torch' requirements.txt > /tmp/req.txt && pip install --no-cache-dir -r /tmp/req.txt
COPY . .
ENV CUDA_DEVICE_MAX_CONNECTIONS=1
ENTRYPOINT ["torchrun", "--nproc-per-node", "gpu", "pretrain_gpt.py"]
CMD ["--help"]
