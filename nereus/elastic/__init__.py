"""Elastic Model Units and the transition graph: plans a job's move between two plans (all models and
stages at once), schedules it on the cluster model and verifies it. Pure Python; no torch.

Entry points: ``transition.plan_transition`` (graph, schedule, report), ``graph.build_graph``,
``schedule.schedule_graph``, ``verify.verify_transition`` / ``verify.assert_valid``, ``emu.build_emus``.
"""
