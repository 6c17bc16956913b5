# Sourced by the GPU scripts that run several processes at once on one GPU (batch_parts.sh,
# recipe_seeds.sh): print the GPU and torch, and start MPS so their kernels can overlap.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS on" || echo "MPS off"
