"""The demo model `fraud-demo`: a synthetic card-transaction process and its training script.

`demo.generator` needs only numpy and is used by tests, benchmarks and load tests at run time.
`demo.train` needs PyTorch and is run only to (re)build ``models/fraud-demo/1``.
"""
