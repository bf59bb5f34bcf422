# Graph builders shared by the scripts; exec'd into the task namespace via DEF.
DEF = r'''
def b_ps(init_local=True):
    v, vi = ps_var()
    l, li = local_var(init=10.0 + task)
    upd = v.assign_add(1.0)
    lupd = l.assign_add(1.0)
    return dict(vh=v.handle, v=v.read_value(), vi=vi, l=l.read_value(), li=li, upd=upd, lupd=lupd,
                init_v=v.initializer, init_l=l.initializer)
'''
