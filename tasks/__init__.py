"""The five stages and their parts. Importing the package filters third-party messages known to be
noise (tasks/log_filter.py; PRECAST_VERBOSE=1 shows them)."""

from tasks.log_filter import quiet_known_noise

quiet_known_noise()
