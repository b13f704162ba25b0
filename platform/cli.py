"""loraplex.platform.cli placeholder"""
