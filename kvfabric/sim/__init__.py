"""kvfabric.sim"""
