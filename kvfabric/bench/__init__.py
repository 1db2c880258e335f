"""kvfabric.bench"""
