"""The Domus service: AS and SS subsystems behind one UDP/TCP port."""
