"""demo_train"""
