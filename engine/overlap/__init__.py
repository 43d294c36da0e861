"""Overlap scheduling: launch batch N+1 before processing batch N's results.

    future_map.py  FutureMap: device-resident ring of next-token ids not known on the host yet
    executor.py    the asynchronous device behind one interface: a forward thread on CPU
    cuda_executor.py  the same interface on CUDA: a forward stream and a side copy stream
    scheduler.py   OverlapScheduler: the Scheduler with the overlapped loop order
"""
