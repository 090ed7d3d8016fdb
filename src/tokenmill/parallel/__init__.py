"""Scale-out by replicas: whole engines on Ray actors behind one router (ray_engine.py, replicas.py)."""
