"""Code imported by two or more roles: message types, layers, sampling, checkpoint I/O.

Nothing here imports gateway/, verify_worker/ or draft_worker/.
"""
