"""Execute a plan: the body of ``hetquant convert`` (``convert.py``).

``transaction`` holds OUTPUT (lock, signals, OS errors, resume; export shares it) and ``move``
moves the finished artifact into it; ``execute`` runs the jobs here or in ``workers``; ``jobs`` / ``native_jobs`` turn
one job's source tensors into output bytes (``writer``); ``hashing`` hashes files as they fill;
``finalize`` and ``manifest`` complete the artifact; ``calibration`` runs ``--calib-data``.
"""
