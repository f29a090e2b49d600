"""Reference models: plain-Python statements of rules the C++ core runs, which the tests hold the C++ to.

Nothing in torch_bps imports these (tests/test_layers.py checks it); they are read and tested, never run in a job.
- rounds.py: a summation server's rounds of one key (the native one: cpp_ext/server/rounds.h);
- codecs.py: a compressed key's decode, sum and encode with the server's error feedback (cpp_ext/server/codecs.h);
- scheduler.py: the client's credit-bounded priority scheduling (the native one: cpp_ext/client/credit_queue.h).
"""
