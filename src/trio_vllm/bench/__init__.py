"""The benchmarks behind ``trio-vllm bench ...`` (the command is in ``trio_vllm.cli._bench``).

Each benchmark runs its anchor in the same run and prints ratios; one private module
per benchmark, imported only when run.
"""
