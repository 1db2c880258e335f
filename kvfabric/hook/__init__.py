"""kvfabric.hook"""
