"""`loraplex check`: suites that probe a running loraplex app over real HTTP the way an
attacker or a broken client would, and say in numbers what it survived."""
