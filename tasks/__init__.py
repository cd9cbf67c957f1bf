"""The five stages and their parts. Importing the package filters third-party messages known to be
noise (tasks/noise.py; PRECAST_VERBOSE=1 shows them)."""

from tasks.noise import quiet_known_noise

quiet_known_noise()
