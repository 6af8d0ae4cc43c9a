{{/* Chart name. */}}
{{- define "specops.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name. */}}
{{- define "specops.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specops.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "specops.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "specops.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specops.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specops.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "specops.secretName" -}}
{{ include "specops.fullname" . }}
{{- end -}}

{{/* Environment shared by the controller and the sidecar: Redis URL and webhook token from Secrets. */}}
{{- define "specops.commonEnv" -}}
- name: SPECOPS_REDIS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret | default (include "specops.secretName" .) }}
      key: {{ .Values.redis.redisUrlKey }}
      optional: true
- name: SPECOPS_WEBHOOK_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.webhook.existingSecret | default (include "specops.secretName" .) }}
      key: {{ .Values.webhook.tokenKey }}
- name: SPECOPS_POD
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end -}}

{{/* The runtime sidecar container, to place beside an inference server container. */}}
{{/* The sidecar's --engine: llamacpp in the inference example's llama-server pod, else sidecar.engine. */}}
{{- define "specops.sidecarEngine" -}}
{{- if and .Values.inferenceExample.enabled (eq .Values.inferenceExample.engine "llamacpp") -}}
llamacpp
{{- else -}}
{{ .Values.sidecar.engine }}
{{- end -}}
{{- end -}}

{{- define "specops.sidecarContainer" -}}
- name: specops-sidecar
  image: {{ include "specops.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["specops", "sidecar"]
  args:
    - --engine={{ include "specops.sidecarEngine" . }}
    {{- range .Values.sidecar.upstreams }}
    - --upstream={{ .name }}={{ .url }}
    {{- end }}
    - --policy=/etc/specops/policy.yaml
    - --listen=0.0.0.0:{{ .Values.sidecar.port }}
    - --reconcile-s={{ .Values.sidecar.reconcileSeconds }}
    - --records={{ .Values.sidecar.records }}
    {{- range .Values.sidecar.args }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "specops.commonEnv" . | nindent 4 }}
  ports:
    - name: specops
      containerPort: {{ .Values.sidecar.port }}
  readinessProbe:
    httpGet: {path: /readyz, port: specops}
    periodSeconds: 5
  livenessProbe:
    httpGet: {path: /healthz, port: specops}
    periodSeconds: 10
  resources:
    {{- toYaml .Values.sidecar.resources | nindent 4 }}
  volumeMounts:
    - name: specops-policy
      mountPath: /etc/specops
      readOnly: true
{{- end -}}

{{/* The policy volume the sidecar needs in the inference pod. */}}
{{- define "specops.policyVolume" -}}
- name: specops-policy
  configMap:
    name: {{ include "specops.fullname" . }}-policy
{{- end -}}

{{/* Controller replicas: the configured count with a shared Redis, 1 with the embedded one. */}}
{{- define "specops.controllerReplicas" -}}
{{- if or .Values.redis.url .Values.redis.existingSecret -}}
{{- .Values.controller.replicas | int -}}
{{- else -}}
1
{{- end -}}
{{- end -}}
