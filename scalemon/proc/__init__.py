"""A process read from outside it, pure Python: what the kernel says of it (`facts`: state, CPU
time, threads), every thread's stack by py-spy (`stacks`, over `frames`, `pyspy` and
`stacktext`), why reading it may be refused (`ptrace`), and one look at a silent rank that puts
them together (`probe`). The hub runs these for the ranks on its host, a node's relay for the
ranks on its node."""
