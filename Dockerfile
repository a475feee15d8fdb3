# GPU image: NVIDIA's PyTorch container already carries torch, CUDA, NCCL (and apex).
# 25.03 ships a torch 2.7 build: requirements.txt needs torch >= 2.6 (24.05's 2.4.0a0 could
# not read Megatron-LM's own checkpoints: no torch.serialization.safe_globals).
FROM nvcr.io/nvidia/pytorch:25.03-py3
WORKDIR /workspace/megatron-gpt
COPY requirements.txt .
# torch is provided by the base image; install the rest without touching it.
RUN grep -v '^torch' requirements.txt > /tmp/req.txt && pip install --no-cache-dir -r /tmp/req.txt
# .dockerignore keeps run outputs (runs/, checkpoints) and .git out of the image
COPY . .
ENV CUDA_DEVICE_MAX_CONNECTIONS=1
ENTRYPOINT ["torchrun", "--nproc-per-node", "gpu", "pretrain_gpt.py"]
CMD ["--help"]
