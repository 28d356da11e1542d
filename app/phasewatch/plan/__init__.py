"""Capacity planning from observed traffic: calibrate a cost model of the deployment from its
own records (`fit.py`), then run what-ifs through the simulator's scheduler (`whatif.py`)."""
