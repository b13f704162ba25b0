"""`loraplex bench offline` and `loraplex probe dtype`: the engine timed in this process.

offline.py runs the fixed workload against HF transformers (and PEFT with adapters);
host_overhead.py, speculative.py and guided.py are its other modes; gemm_probe.py and
ceiling.py time this machine's matmuls and the throughput they allow, and record the
dtype `dtype: auto` runs in; kernels.py times the Triton kernels on a GPU.
"""
