"""FP8 quantization (docs/design.md, "FP8"): spec/quant.py parses what to serve, fp8.py is the
torch arithmetic and reference, triton_fp8.py the CUDA kernels, linear.py the `Fp8Linear`
that plugs into linear.py's seam, loading.py how its tensors load."""
