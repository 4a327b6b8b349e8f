"""What several test files share, in one place (no test file imports another):

- ``variants``: the factory of test variants, and slow / wrong / counting variant bodies;
- ``calibration``: the one quick timing configuration (and its ``kv`` flags), a conv call,
  table rows made by hand, the ``kv`` command line run in-process;
- ``conformance``: the cases a variant claims, and ``assert_conforms``;
- ``ascend_conv``: CPU doubles of the Ascend and causal-conv1d kernels, and adapters on them;
- ``torch_npu_double``: a CPU double of torch_npu's RMSNorm kernels;
- ``no_sync``: the guard that fails on any host synchronisation;
- ``naive``: a scalar oracle for the conv reference;
- ``processes``: a free port, and the two-rank gloo launcher.
- ``fast_steps``: the engine adapters with their fast steps refused (their general path).
"""
