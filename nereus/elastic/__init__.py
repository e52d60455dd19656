"""Elastic Model Units and the transition plan: plans a job's move between two plans (all models and
stages at once) as typed steps, schedules it on the cluster model and verifies it. Pure Python; no torch.

Entry points: ``transition.plan_transition`` (plan, schedule, report), ``graph.build_graph`` (returns a
``plan.TransitionPlan``), ``schedule.schedule_graph``, ``verify.verify_transition`` / ``verify.assert_valid``,
``emu.build_emus``.
"""
