"""This machine: the backend (`backend.py`), which records and signals jobs, and the detached
runner process (`runner.py`) that runs torchrun for one job and writes its status."""
