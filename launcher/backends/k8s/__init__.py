"""Kubernetes: the backend (`backend.py`), the PyTorchJob / JobSet manifests it renders
(`manifest.py`) and the kubectl calls it makes (`kubectl.py`)."""
